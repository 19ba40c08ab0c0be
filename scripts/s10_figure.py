"""Draw chapters/figures/s10_scheduler.png from the S10 benchmark's figures (the chapter's plot).

    python benchmarks/bench_s10_scheduler.py --json chapters/figures/s10_scheduler.json
    python scripts/s10_figure.py            # writes chapters/figures/s10_scheduler.png
    python scripts/s10_figure.py --check    # exits 1 when the committed file is not what it draws

Four panels against the KV capacity (tokens), one line per policy (FCFS, priority), every
point one run of benchmarks/bench_s10_scheduler.py: output tokens/s; preemptions; TTFT p50 and
p99; and the end-to-end p99 of each priority class, where priority's fairness cost shows (its
low-priority requests wait behind every high-priority one). Nothing is drawn by hand: every
value is read from the JSON. One legend below the panels, off the data
(tests/legend_check.py checks it).
"""
from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "chapters" / "figures" / "s10_scheduler.json"
OUT = ROOT / "chapters" / "figures" / "s10_scheduler.png"
STYLE = {"fcfs": dict(color="#2b6cb0", marker="o"), "priority": dict(color="#c05621",
                                                                    marker="s")}
CLASS_STYLE = {"low": "--", "high": ":"}


def series(runs, policy, value):
    mine = sorted((r for r in runs if r["policy"] == policy), key=lambda r: r["kv_capacity"])
    return [r["kv_capacity"] for r in mine], [value(r) for r in mine]


def build_figure(figures: dict):
    runs, config = figures["runs"], figures["config"]
    fig, axes = plt.subplots(1, 4, figsize=(15, 4.2))
    panels = [
        ("output tokens/s", lambda r: r["tokens_per_s"], None),
        ("preemptions", lambda r: r["preemptions"], None),
        ("TTFT (ms): p50 solid, p99 dashed", lambda r: r["ttft"]["p50_ms"],
         lambda r: r["ttft"]["p99_ms"]),
        ("end-to-end p99 (ms) by class", None, None),
    ]
    for ax, (title, first, second) in zip(axes, panels):
        for policy, style in STYLE.items():
            if first is not None:
                ax.plot(*series(runs, policy, first), label=policy, **style)
            if second is not None:
                ax.plot(*series(runs, policy, second), linestyle="--", alpha=0.8, **style)
            if first is None:
                for cls, dash in CLASS_STYLE.items():
                    ax.plot(*series(runs, policy,
                                    lambda r: r["classes"][cls]["e2e"]["p99_ms"]),
                            linestyle=dash, label=f"{policy}, {cls} priority", **style)
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("KV capacity (tokens)")
        ax.grid(alpha=0.3)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)     # a margin above the highest point
    handles, labels = axes[0].get_legend_handles_labels()
    more_h, more_l = axes[3].get_legend_handles_labels()
    fig.legend(handles + more_h, labels + more_l, loc="lower center", ncol=6, frameon=False,
               bbox_to_anchor=(0.5, 0.0), fontsize=10)
    fig.suptitle(f"S10 scheduler, bundled model: {config['num_requests']} mixed requests, "
                 f"Poisson {config['rate_per_s']:g}/s, max_num_seqs {config['max_num_seqs']}, "
                 f"{config['device']} x {config['threads']} thread "
                 f"(fits everything: {config['fits_everything_tokens']} tokens)", fontsize=12)
    fig.subplots_adjust(left=0.05, right=0.99, top=0.82, bottom=0.25, wspace=0.28)
    return fig


def render(figures: dict) -> bytes:
    fig = build_figure(figures)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DATA),
                        help="the benchmark's JSON (default: %(default)s)")
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed file instead of writing it")
    args = parser.parse_args(argv)
    png = render(json.loads(Path(args.data).read_text()))
    if args.check:
        same = OUT.exists() and OUT.read_bytes() == png
        print("up to date" if same else f"{OUT} differs from what {args.data} draws")
        return 0 if same else 1
    OUT.write_bytes(png)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
