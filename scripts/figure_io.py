"""What the chapter figure scripts (scripts/sNN_figure.py) share: a matplotlib figure drawn to
PNG bytes that depend only on the drawing, and the command line that writes the committed PNG
or checks that it is what the data draws.

    python scripts/sNN_figure.py                  # writes the chapter's PNG
    python scripts/sNN_figure.py --check          # exits 1 when the committed file differs
    python scripts/sNN_figure.py --data other.json [--check]

Not a script itself: each figure script keeps its own DATA, OUT and build_figure(figures) and
hands them to figure_main.
"""
from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def render(fig) -> bytes:
    """fig as PNG bytes at 100 dpi, with no "Software" stamp (the same drawing gives the same
    bytes whatever matplotlib wrote it); the figure is closed."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()


def figure_main(description: str, build_figure, data_path: Path, out_path: Path,
                argv=None) -> int:
    """The figure scripts' main: draw build_figure(the JSON at --data, default data_path) and
    write it to out_path, or with --check compare it with out_path's bytes (0 when equal)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data", default=str(data_path),
                        help="the benchmark's JSON (default: %(default)s)")
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed file instead of writing it")
    args = parser.parse_args(argv)
    png = render(build_figure(json.loads(Path(args.data).read_text())))
    if args.check:
        same = out_path.exists() and out_path.read_bytes() == png
        print("up to date" if same else f"{out_path} differs from what {args.data} draws")
        return 0 if same else 1
    out_path.write_bytes(png)
    print(f"wrote {out_path.relative_to(ROOT)}")
    return 0
