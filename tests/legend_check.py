"""Which data does a matplotlib legend cover? A checker for the course's plots.

`covered_by_legends(fig)` draws the figure (or takes the renderer of a draw in progress) and, for
every legend in it (axes legends and figure legends), lists the data artists of every axes of the
figure that have a point inside the legend's box, in display coordinates:

- Line2D: its vertices where it has markers (a marker counts when its disc reaches the box), and
  points every `step_px` pixels along each drawn segment (so a line that merely crosses the box
  between two far-apart vertices is caught); step draw styles are followed as drawn;
- PathCollection (scatter): each offset, with its marker's radius;
- other collections (fill_between's PolyCollection, vlines' LineCollection): each path, as a
  filled region when it has a face colour, else as polylines sampled like a line;
- patches (bar Rectangles, fill Polygons, axvspan): the patch's region;
- images: their extent; texts (annotations, ax.text) when `include_text`.

Only what is visible counts: artists set invisible or fully transparent are skipped, and an
artist clipped to its axes counts only inside the axes, so a legend outside the axes covers
nothing of them. A point on the box's edge counts as covered.

The notebook tests run it in the kernel on every draw of every figure (`install()` registers a
pyplot figure hook through the public rcParams["figure.hooks"] and a draw_event callback per
figure); no matplotlib method is replaced.
"""
from __future__ import annotations

import json
import math

import numpy as np
from matplotlib.axes import Axes
from matplotlib.cbook import STEP_LOOKUP_MAP
from matplotlib.collections import Collection, PathCollection
from matplotlib.colors import to_rgba_array
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.legend import Legend
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.path import Path
from matplotlib.text import Text
from matplotlib.transforms import Bbox

NO_STYLE = {None, "None", "none", "", " "}
MAX_POINTS = 5            # covered points quoted per artist


def _visible(artist) -> bool:
    alpha = artist.get_alpha()
    return artist.get_visible() and (alpha is None or alpha > 0)


def _clip_mask(artist, pts: np.ndarray) -> np.ndarray:
    """True for the display points an artist's clip box lets through (all when unclipped)."""
    box = artist.get_clip_box() if artist.get_clip_on() else None
    if box is None or len(pts) == 0:
        return np.ones(len(pts), bool)
    return ((pts[:, 0] >= box.x0) & (pts[:, 0] <= box.x1)
            & (pts[:, 1] >= box.y0) & (pts[:, 1] <= box.y1))


def _inside(box: Bbox, pts: np.ndarray, margin: float | np.ndarray = 0.0) -> np.ndarray:
    return ((pts[:, 0] >= box.x0 - margin) & (pts[:, 0] <= box.x1 + margin)
            & (pts[:, 1] >= box.y0 - margin) & (pts[:, 1] <= box.y1 + margin))


def _densify(pts: np.ndarray, step_px: float) -> np.ndarray:
    """The vertices of a polyline plus points every `step_px` along each segment whose two ends
    are finite (a NaN breaks a matplotlib line, so nothing is drawn across it)."""
    out = [pts[np.isfinite(pts).all(axis=1)]]
    for a, b in zip(pts[:-1], pts[1:]):
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            continue
        n = int(math.ceil(np.hypot(*(b - a)) / step_px))
        if n > 1:
            t = np.linspace(0.0, 1.0, n + 1)[1:-1, None]
            out.append(a + t * (b - a))
    return np.concatenate(out) if out else np.empty((0, 2))


def _has_face(artist) -> bool:
    try:
        faces = to_rgba_array(artist.get_facecolor())
    except (TypeError, ValueError):
        return False
    return bool(len(faces)) and bool((faces[:, 3] > 0).any())


def _region_hit(box: Bbox, path: Path) -> np.ndarray | None:
    """Corners of the overlap of a filled display-space path with the box, or None."""
    if len(path.vertices) == 0 or not path.intersects_bbox(box, filled=True):
        return None
    ext = path.get_extents()
    x0, x1 = max(ext.x0, box.x0), min(ext.x1, box.x1)
    y0, y1 = max(ext.y0, box.y0), min(ext.y1, box.y1)
    return np.array([[x0, y0], [x1, y1]])


def _clip_box_path(artist, path: Path) -> Path:
    """A display path cut to the artist's clip box (bars above the y-limit are drawn cut)."""
    box = artist.get_clip_box() if artist.get_clip_on() else None
    if box is None:
        return path
    polys = path.clip_to_bbox(box, inside=True).to_polygons()
    if not polys:
        return Path(np.empty((0, 2)))
    return Path.make_compound_path(*(Path(p, closed=True) for p in polys))


def _artist_hits(artist, box: Bbox, renderer, step_px: float, include_text: bool):
    """(kind, display points) for the parts of one data artist inside the legend box."""
    if not _visible(artist):
        return []
    hits = []
    if isinstance(artist, Line2D):
        xy = artist.get_transform().transform(np.asarray(artist.get_xydata(), float))
        if artist.get_marker() not in NO_STYLE and artist.get_markersize() > 0:
            r = renderer.points_to_pixels(artist.get_markersize() / 2)
            keep = _clip_mask(artist, xy) & _inside(box, xy, r)
            if keep.any():
                hits.append(("markers", xy[keep]))
        if artist.get_linestyle() not in NO_STYLE and artist.get_linewidth() > 0 and len(xy) > 1:
            style = artist.get_drawstyle()
            if style in STEP_LOOKUP_MAP and style != "default":
                xy = np.column_stack(STEP_LOOKUP_MAP[style](xy[:, 0], xy[:, 1]))
            pts = _densify(xy, step_px)
            r = renderer.points_to_pixels(artist.get_linewidth() / 2)
            keep = _clip_mask(artist, pts) & _inside(box, pts, r)
            if keep.any():
                hits.append(("line", pts[keep]))
    elif isinstance(artist, PathCollection):
        offsets = np.asarray(artist.get_offsets(), float)
        pts = artist.get_offset_transform().transform(offsets)
        sizes = np.asarray(artist.get_sizes(), float)
        if len(sizes) == 0:
            sizes = np.array([0.0])
        r = renderer.points_to_pixels(np.sqrt(np.resize(sizes, len(pts))) / 2)
        keep = _clip_mask(artist, pts) & _inside(box, pts, r)
        if keep.any():
            hits.append(("scatter", pts[keep]))
    elif isinstance(artist, Collection):
        filled = _has_face(artist)
        transform = artist.get_transform()
        for path in artist.get_paths():
            dpath = transform.transform_path(path)
            if filled:
                region = _region_hit(box, _clip_box_path(artist, dpath))
                if region is not None:
                    hits.append(("region", region))
            else:
                for poly in dpath.to_polygons(closed_only=False):
                    pts = _densify(np.asarray(poly, float), step_px)
                    keep = _clip_mask(artist, pts) & _inside(box, pts)
                    if keep.any():
                        hits.append(("line", pts[keep]))
    elif isinstance(artist, Patch):
        dpath = artist.get_transform().transform_path(artist.get_path())
        if _has_face(artist) or artist.get_fill():
            region = _region_hit(box, _clip_box_path(artist, dpath))
            if region is not None:
                hits.append(("region", region))
        else:
            pts = _densify(np.asarray(dpath.vertices, float), step_px)
            keep = _clip_mask(artist, pts) & _inside(box, pts)
            if keep.any():
                hits.append(("outline", pts[keep]))
    elif isinstance(artist, AxesImage):
        ext = artist.get_window_extent(renderer)
        if ext.overlaps(box):
            hits.append(("image", np.array([[max(ext.x0, box.x0), max(ext.y0, box.y0)],
                                            [min(ext.x1, box.x1), min(ext.y1, box.y1)]])))
    elif include_text and isinstance(artist, Text) and artist.get_text().strip():
        ext = artist.get_window_extent(renderer)
        if ext.overlaps(box):
            hits.append(("text", np.array([[ext.x0, ext.y0], [ext.x1, ext.y1]])))
    return hits


def _axes_title(ax: Axes) -> str:
    titles = [ax.get_title(loc) for loc in ("left", "center", "right")]
    return " / ".join(t for t in titles if t) or f"axes {ax.figure.axes.index(ax)}"


def _label(artist, containers: dict) -> str:
    label = artist.get_label() if hasattr(artist, "get_label") else ""
    if id(artist) in containers:        # a bar's Rectangle: its BarContainer has the label
        label = containers[id(artist)]
    if isinstance(artist, Text):
        return f"text {artist.get_text()!r}"
    if label and not label.startswith("_"):
        return label
    return type(artist).__name__


def data_artists(ax: Axes, include_text: bool = True) -> list:
    """The artists of an axes that carry data (not its legend, spines, grid or title)."""
    artists = [*ax.lines, *ax.collections, *ax.patches, *ax.images]
    if include_text:
        artists += list(ax.texts)
    return artists


def covered_by_legends(fig: Figure, renderer=None, step_px: float = 3.0,
                       include_text: bool = True) -> list[dict]:
    """Every (legend, data artist) pair where the artist has points inside the legend's box.

    Each entry: legend (the title of the axes holding it, or "figure legend"), axes (the title of
    the axes whose data is covered), artist (its label, else its type), kind (line, markers,
    scatter, region, outline, image or text), count (covered display points; 2 corners for a
    region), points (up to MAX_POINTS of them in that axes' data coordinates, rounded).
    Without a renderer the figure is drawn first (for the legends' final positions).
    """
    if renderer is None:
        if not hasattr(fig.canvas, "get_renderer"):   # a closed pyplot figure: give it one
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            FigureCanvasAgg(fig)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
    legends = [lg for lg in fig.findobj(Legend) if lg.get_visible()]
    axes = [a for a in fig.findobj(Axes) if a.get_visible()]
    found = []
    for legend in legends:
        box = legend.get_window_extent(renderer)
        owner = legend.axes
        where = _axes_title(owner) if owner is not None else "figure legend"
        for ax in axes:
            containers = {id(child): c.get_label() for c in ax.containers for child in c
                          if child is not None}
            for artist in data_artists(ax, include_text):
                for kind, pts in _artist_hits(artist, box, renderer, step_px, include_text):
                    data = ax.transData.inverted().transform(pts[:MAX_POINTS])
                    found.append({"legend": where, "axes": _axes_title(ax),
                                  "artist": _label(artist, containers), "kind": kind, "count": len(pts),
                                  "points": [[float(f"{v:.4g}") for v in p] for p in data]})
    return found


def describe(found: list[dict]) -> str:
    """One line per covered artist, for an assertion message."""
    return "\n".join(
        f"  the check failed: {f['error']}" if "error" in f else
        f"  legend of {f['legend']!r} covers {f['count']} {f['kind']} point(s) of "
        f"{f['artist']!r} in axes {f['axes']!r}, e.g. {f['points']}" for f in found)


# ---------------------------------------------------------------------------------------------
# In a notebook kernel: check every figure at every draw
# ---------------------------------------------------------------------------------------------

FIGURES: list = []        # every pyplot figure made since install(), closed ones too
REPORT: list[dict] = []   # one entry per distinct covering found at a draw
_SEEN: set = set()


_CURRENT_CELL = {"source": None}


def _remember_cell(info) -> None:
    """IPython pre_run_cell event: the source of the cell about to run."""
    _CURRENT_CELL["source"] = info.raw_cell


def _on_draw(event) -> None:
    fig = event.canvas.figure
    try:
        found = covered_by_legends(fig, renderer=event.renderer)
    except Exception as exc:   # a broken check must fail the test, not the notebook's cell
        found = [{"error": f"{type(exc).__name__}: {exc}"}]
    if not found:
        return
    titles = [fig.get_suptitle()] if fig.get_suptitle() else []
    entry = {"cell_source": _CURRENT_CELL["source"], "figure": fig.number if hasattr(fig, "number") else None,
             "title": " | ".join(titles + [_axes_title(a) for a in fig.axes]), "covered": found}
    key = json.dumps(entry, sort_keys=True)
    if key not in _SEEN:
        _SEEN.add(key)
        REPORT.append(entry)


def track(fig: Figure) -> None:
    """rcParams["figure.hooks"] entry: keep the figure and check it whenever it is drawn."""
    FIGURES.append(fig)
    fig.canvas.mpl_connect("draw_event", _on_draw)


def install() -> None:
    """Check every pyplot figure made from now on, noting the cell that drew it (idempotent)."""
    import matplotlib
    from IPython import get_ipython
    shell = get_ipython()
    if shell is not None and _remember_cell not in shell.events.callbacks["pre_run_cell"]:
        shell.events.register("pre_run_cell", _remember_cell)
    hook = f"{__name__}:track"
    if hook not in matplotlib.rcParams["figure.hooks"]:
        matplotlib.rcParams["figure.hooks"] = [*matplotlib.rcParams["figure.hooks"], hook]


def report_json() -> str:
    """The report so far as JSON (what the notebook tests read back from the kernel)."""
    return json.dumps({"figures": len(FIGURES), "covered": REPORT})
