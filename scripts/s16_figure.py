"""Draw chapters/figures/s16_host.png from the S16 benchmark's record.

    python benchmarks/bench_s16_host.py --record   # writes the JSON below
    python scripts/s16_figure.py            # writes chapters/figures/s16_host.png
    python scripts/s16_figure.py --check    # exits 1 when the committed file is not what it draws

Four panels, every value read from the JSON (section letters are the benchmark's), nothing
drawn by hand:

- top left (A): where a decode step's time goes, per model and batch size: one bar per engine
  variant measured there (eager, static, compiled, async eager, async compiled, ...), its
  height the variant's median step as a share of the eager step's (so the eager bar is 1 and a
  shorter bar is a faster step), split into the forward (solid) and the host's part, step less
  forward (hatched; for an async loop the host work the forward did not hide); the eager
  step's milliseconds written under each group;
- top right (B): compiled against eager per step (the ratio of median steps) against the batch
  size: the bundled model with short and with long contexts, the mid-size model; dashed: the
  issue's 1.5x target, dotted: 1 (no gain);
- bottom left (D): async scheduling at its batch size on the bundled model: each variant's
  median step split into forward and host as in A, each async variant beside its synchronous
  twin, with a tick at the bound the benchmark checks (the twin's step x (1 - host fraction /
  2));
- bottom right (E): batch 1 on the mid-size model (the bundled one in a --quick run): decode
  tokens per second of each engine, with the share of its bandwidth floor written beside the
  bar; an engine the benchmark skipped (its "skipped": compiled int4 when torch.compile cannot
  trace S14's weights) gets an empty row that says why.

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
from matplotlib.patches import Patch  # noqa: E402
from figure_io import figure_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "chapters" / "figures" / "s16_host.json"
OUT = ROOT / "chapters" / "figures" / "s16_host.png"

# variant label -> colour; variants not listed get a grey (a new variant still draws)
COLORS = {"eager": "#4a5568", "static": "#dd6b20", "compiled": "#2b6cb0",
          "async eager": "#805ad5", "async compiled": "#319795",
          "mp": "#d69e2e", "async mp": "#d53f8c",
          "graphs": "#38a169", "compiled graphs": "#276749"}
OTHER_COLOR = "#a0aec0"
HOST_HATCH = "////"
MODEL_NAMES = {"bundled": "bundled", "mid": "mid-size"}
SPEEDUP_LINES = [("short", "bundled", "#2b6cb0", "-", "o", "bundled model, short contexts"),
                 ("long", "bundled", "#2b6cb0", "--", "s", "bundled model, long contexts"),
                 ("short", "mid", "#dd6b20", "-", "^", "mid-size model, short contexts")]


def color(label: str) -> str:
    return COLORS.get(label, OTHER_COLOR)


def variant_order(labels) -> list[str]:
    """labels in the benchmark's order (COLORS lists it), any other label after them."""
    labels = list(dict.fromkeys(labels))
    return [v for v in COLORS if v in labels] + [v for v in labels if v not in COLORS]


def host_groups(figures: dict) -> list[tuple[str, int, float, list[tuple[str, float, float]]]]:
    """Panel A's data: [(model key, batch, eager step ms, [(variant, forward share, host share)])],
    shares of the eager step, for every variant measured at that batch (a negative host part,
    an async loop whose forward outlasted the whole step's median, is drawn as 0)."""
    groups = []
    for key, part in figures["host"]["models"].items():
        for batch, rows in sorted(part["batches"].items(), key=lambda item: int(item[0])):
            if "eager" not in rows:
                continue
            base = rows["eager"]["step_ms"]
            bars = [(label, rows[label]["forward_ms"] / base,
                     max(0.0, rows[label]["host_ms"]) / base)
                    for label in variant_order(rows)]
            groups.append((key, int(batch), base, bars))
    return groups


def speedup_lines(figures: dict) -> list[tuple[str, str, str, str, list[int], list[float]]]:
    """Panel B's data: [(legend label, colour, line style, marker, batches, ratios)]."""
    out = []
    compiled = figures["compiled"]
    for context, key, line_color, style, marker, label in SPEEDUP_LINES:
        rows = compiled.get(context, {}).get(key, {})
        if rows:
            batches = sorted(rows, key=int)
            out.append((label, line_color, style, marker, [int(b) for b in batches],
                        [rows[b]["ratio"] for b in batches]))
    return out


def async_bars(figures: dict) -> list[tuple[str, float, float, float | None]]:
    """Panel D's data: [(variant, forward ms, host ms, bound ms or None)], each async variant
    right after its synchronous twin, then any variant measured but in no pair."""
    part = figures["async"]
    rows = part["rows"]
    bounds = {c["async"]: c["bound_ms"] for c in part["checks"]}
    order = []
    for c in part["checks"]:
        for label in (c["sync"], c["async"]):
            if label not in order:
                order.append(label)
    order += [label for label in rows if label not in order]
    return [(label, rows[label]["forward_ms"], max(0.0, rows[label]["host_ms"]),
             bounds.get(label)) for label in order if label in rows]


def int4_bars(figures: dict) -> list[tuple[str, float | None, float | str]]:
    """Panel E's data: [(engine, tokens/s, fraction of the bandwidth floor)] as measured, then
    [(engine, None, why)] for each engine the benchmark skipped."""
    part = figures["int4"]
    bars = [(label, r["tokens_per_s"], r["fraction_of_floor"])
            for label, r in part["rows"].items()]
    return bars + [(label, None, f"not run: torch.compile failed ({why['error']})")
                   for label, why in part.get("skipped", {}).items()]


def missing(ax, what: str) -> None:
    ax.set_axis_off()
    ax.text(0.5, 0.5, f"no {what} section in this run", ha="center", va="center",
            transform=ax.transAxes, color="0.4")


def draw_host(ax, figures: dict) -> None:
    if "host" not in figures:
        return missing(ax, "host (A)")
    groups = host_groups(figures)
    width = 0.8 / max((len(bars) for *_, bars in groups), default=1)
    ticks, labels = [], []
    x = 0.0
    last_key = None
    for key, batch, base, bars in groups:
        if last_key is not None and key != last_key:
            x += 0.5                                   # a gap between the two models
        left = x - width * (len(bars) - 1) / 2
        for i, (label, forward, host) in enumerate(bars):
            pos = left + i * width
            ax.bar(pos, forward, width * 0.92, color=color(label), edgecolor="white", lw=0.5)
            ax.bar(pos, host, width * 0.92, bottom=forward, color=color(label), alpha=0.45,
                   hatch=HOST_HATCH, edgecolor="white", lw=0.5)
        ticks.append(x)
        labels.append(f"{MODEL_NAMES.get(key, key)}\nB = {batch}\n{base:.2f} ms")
        last_key = key
        x += 1.0
    ax.axhline(1.0, color="0.3", ls=":", lw=1)
    ax.set_xticks(ticks, labels, fontsize=8)
    top = max((f + h for _, _, _, bars in groups for _, f, h in bars), default=1.0)
    ax.set_ylim(0, max(1.15, top * 1.08))
    ax.set_ylabel("step time, share of the eager step")
    ax.set_title("A. where a decode step's time goes\n(solid: forward; hatched: host = step "
                 "- forward; under each group: the eager step)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")


def draw_speedups(ax, figures: dict) -> None:
    if "compiled" not in figures:
        return missing(ax, "compiled (B)")
    lines = speedup_lines(figures)
    top = 1.0
    for label, line_color, style, marker, batches, ratios in lines:
        ax.plot(batches, ratios, style, marker=marker, color=line_color, ms=6,
                mfc=line_color if style == "-" else "white")
        top = max(top, *ratios)
    target = figures["compiled"]["target"]
    ax.axhline(target, color="#c53030", ls="--", lw=1)
    ax.axhline(1.0, color="0.3", ls=":", lw=1)
    batches = sorted({b for *_, bs, _ in lines for b in bs}) or [1]
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlim(batches[0] / 1.4, batches[-1] * 1.4)
    ax.set_ylim(0, max(top, target) * 1.15)
    ax.set_xlabel("B, requests decoding in the step")
    ax.set_ylabel("eager step / compiled step")
    ax.set_title(f"B. the compiled step against eager\n(dashed: the {target:g}x target; "
                 "dotted: no gain)", fontsize=10)
    ax.grid(alpha=0.3)


def draw_async(ax, figures: dict) -> None:
    if "async" not in figures:
        return missing(ax, "async (D)")
    bars = async_bars(figures)
    width = 0.7
    for i, (label, forward, host, bound) in enumerate(bars):
        ax.bar(i, forward, width, color=color(label), edgecolor="white", lw=0.5)
        ax.bar(i, host, width, bottom=forward, color=color(label), alpha=0.45,
               hatch=HOST_HATCH, edgecolor="white", lw=0.5)
        if bound is not None:
            ax.plot([i - width / 2, i + width / 2], [bound, bound], color="#c53030", lw=2)
    ax.set_xticks(range(len(bars)), [label.replace(" ", "\n") for label, *_ in bars],
                  fontsize=8)
    top = max((max(f + h, b or 0) for _, f, h, b in bars), default=1.0)
    ax.set_ylim(0, top * 1.15)
    ax.set_ylabel("median step, ms")
    ax.set_title(f"D. async scheduling, bundled model, B = {figures['async']['batch']}\n"
                 "(red: the bound, sync step x (1 - host fraction / 2))", fontsize=10)
    ax.grid(alpha=0.3, axis="y")


def draw_int4(ax, figures: dict) -> None:
    if "int4" not in figures:
        return missing(ax, "int4 (E)")
    bars = int4_bars(figures)
    top = max((t for _, t, _ in bars if t is not None), default=1.0)
    for i, (label, tokens, floor) in enumerate(bars):
        if tokens is None:                      # skipped: the row says why
            ax.text(top * 0.01, i, floor, va="center", fontsize=8, color="0.4")
            continue
        ax.barh(i, tokens, 0.7, color="#2c7a7b" if "int4" in label else "#81e6d9")
        ax.text(tokens + top * 0.01, i, f"{tokens:.0f} tok/s, {floor:.0%} of its floor",
                va="center", fontsize=8)
    ax.set_yticks(range(len(bars)), [label for label, *_ in bars], fontsize=8)
    ax.set_ylim(len(bars) - 0.5, -0.5)             # the first engine on top
    ax.set_xlim(0, top * 1.6)
    ax.set_xlabel("decode tokens per second, batch 1")
    name = figures["int4"].get("name", figures["int4"]["model"])
    ax.set_title(f"E. one request on {name}\n(floor: the bytes a token reads / the "
                 "measured bandwidth)", fontsize=10)
    ax.grid(alpha=0.3, axis="x")


def build_figure(figures: dict):
    fig, axes = plt.subplots(2, 2, figsize=(16, 11.5),
                             gridspec_kw={"width_ratios": [1.45, 1], "hspace": 0.45})
    (host, speed), (asyn, int4) = axes
    draw_host(host, figures)
    draw_speedups(speed, figures)
    draw_async(asyn, figures)
    draw_int4(int4, figures)
    shown = [label for *_, bars in (host_groups(figures) if "host" in figures else [])
             for label, *_ in bars]
    shown += [label for label, *_ in (async_bars(figures) if "async" in figures else [])]
    variants = [(Patch(color=color(label)), label) for label in variant_order(shown)]
    parts = [(Patch(facecolor="0.45", edgecolor="white"), "solid: forward"),
             (Patch(facecolor="0.45", alpha=0.45, hatch=HOST_HATCH, edgecolor="white"),
              "hatched: host (step - forward)")]
    fig.legend(*zip(*(variants + parts)), loc="lower center", ncol=min(4, len(variants) + 2),
               frameon=False, bbox_to_anchor=(0.33, 0.0), fontsize=9, title="A and D",
               title_fontsize=9)
    lines = [(Line2D([], [], color=c, ls=s, marker=m, mfc=c if s == "-" else "white"), label)
             for _, _, c, s, m, label in SPEEDUP_LINES]
    fig.legend(*zip(*lines), loc="lower center", ncol=1, frameon=False,
               bbox_to_anchor=(0.8, 0.0), fontsize=9, title="B", title_fontsize=9)
    config = figures["config"]
    fig.suptitle(f"S16, the host side of a step: S13's engine, eager, static, compiled and "
                 f"async; {config['device']}, torch {config['torch']}, {config['threads']} "
                 f"thread, {config['logical_cores']} logical cores"
                 + (" (a --quick run: not the record)" if config.get("quick") else ""),
                 fontsize=12)
    fig.subplots_adjust(left=0.06, right=0.98, top=0.91, bottom=0.17, wspace=0.3)
    return fig


def main(argv=None) -> int:
    return figure_main(__doc__.splitlines()[0], build_figure, DATA, OUT, argv)


if __name__ == "__main__":
    sys.exit(main())
