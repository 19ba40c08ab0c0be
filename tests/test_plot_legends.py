"""Plot legends never cover data: the checker (tests/legend_check.py) on hand-made figures, then
on every figure each notebook draws and on S07's roofline plot (code/s07_roofline.py).

The notebooks are executed by notebook_testing.execute, which checks each figure at every draw
in the kernel; a notebook already run in this test run (by its own tests/test_sNN_*notebook.py
or for the site's build, in this process or another) is not run again.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from legend_check import covered_by_legends, describe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("s[0-9][0-9]_*.ipynb"))


@pytest.fixture
def figure():
    fig, ax = plt.subplots(figsize=(6, 4))
    yield fig, ax
    plt.close(fig)


def kinds(found):
    return {(f["artist"], f["kind"]) for f in found}


# ---------------------------------------------------------------------------------------------
# The checker on figures made by hand
# ---------------------------------------------------------------------------------------------

def test_a_legend_on_top_of_a_line_is_caught(figure):
    fig, ax = figure
    ax.plot([0, 10], [0, 10], label="diagonal")
    ax.legend(loc="center")
    found = covered_by_legends(fig)
    assert kinds(found) == {("diagonal", "line")}
    # the covered points are on the line, in data coordinates, near the middle of the axes
    pts = np.array(found[0]["points"])
    assert np.allclose(pts[:, 0], pts[:, 1], atol=1e-2) and (abs(pts - 5) < 2.5).all()


def test_a_line_crossing_the_box_between_two_far_vertices_is_caught(figure):
    # Two vertices only, both far outside the legend: the segment between them is what counts.
    fig, ax = figure
    ax.plot([0, 10], [5, 5], label="flat")
    ax.set_ylim(0, 10)
    ax.legend(loc="center")
    assert kinds(covered_by_legends(fig)) == {("flat", "line")}


def test_a_legend_outside_the_axes_covers_nothing(figure):
    fig, ax = figure
    ax.plot([0, 10], [0, 10], label="diagonal")
    ax.scatter([5], [5], label="dot")
    ax.bar([2, 8], [3, 9], label="bars")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    assert covered_by_legends(fig) == []


def test_a_legend_in_an_empty_corner_passes(figure):
    fig, ax = figure
    ax.plot([0, 10], [0, 10], "o-", label="diagonal")
    ax.legend(loc="upper left")
    assert covered_by_legends(fig) == []


def test_markers_count_by_their_disc_not_their_centre(figure):
    fig, ax = figure
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 10)
    legend_box = ax.legend(handles=[plt.Line2D([], [], label="key")], loc="center")
    fig.canvas.draw()
    box = legend_box.get_window_extent(fig.canvas.get_renderer())
    # A big marker whose centre is 3 px right of the box: its 10 px radius reaches into it.
    x, y = ax.transData.inverted().transform((box.x1 + 3, (box.y0 + box.y1) / 2))
    ax.plot([x], [y], "o", ms=20 * 72 / fig.dpi, label="big")
    ax.plot([x], [y + 3], "o", ms=2, label="far")
    assert kinds(covered_by_legends(fig)) == {("big", "markers")}


def test_scatter_bars_fill_and_text_under_a_legend_are_caught():
    fig, axes = plt.subplots(1, 4, figsize=(12, 3))
    try:
        axes[0].scatter([5], [5], s=40, label="dot")
        axes[0].set(xlim=(0, 10), ylim=(0, 10))
        axes[1].bar([0, 1, 2], [5, 5, 5], label="bars")
        axes[2].fill_between([0, 10], [0, 0], [10, 10], label="band")
        axes[3].text(0.5, 0.5, "note", transform=axes[3].transAxes, ha="center", va="center")
        axes[3].plot([], [], label="empty")
        for ax in axes:
            ax.legend(loc="center")
        found = covered_by_legends(fig)
        assert kinds(found) == {("dot", "scatter"), ("bars", "region"), ("band", "region"),
                                ("text 'note'", "text")}
        assert all(f["legend"] == f["axes"] for f in found)   # each legend covers its own axes
        assert kinds(covered_by_legends(fig, include_text=False)) == {
            ("dot", "scatter"), ("bars", "region"), ("band", "region")}
    finally:
        plt.close(fig)


def test_data_clipped_away_or_hidden_does_not_count(figure):
    fig, ax = figure
    ax.plot([0, 10], [0, 10], label="shown")
    hidden = ax.plot([0, 10], [10, 0], label="hidden")[0]
    hidden.set_visible(False)
    ax.plot([0, 10], [20, 20], label="above the limits")   # clipped by the axes
    ax.set_ylim(0, 10)
    ax.legend(loc="lower right")
    assert covered_by_legends(fig) == []


def test_a_figure_legend_over_another_axes_is_caught():
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3))
    try:
        left.plot([0, 1], [0, 1], label="a")
        right.plot([0, 1], [0.5, 0.5], label="b")
        fig.legend(loc="center right", bbox_to_anchor=(0.95, 0.55))
        found = covered_by_legends(fig)
        assert ("b", "line") in kinds(found)
        assert {f["legend"] for f in found} == {"figure legend"}
        assert "covers" in describe(found) and "'b'" in describe(found)
    finally:
        plt.close(fig)


def test_step_lines_are_followed_as_drawn(figure):
    # steps-post from (0, 0) to (10, 10) draws a flat run at y = 0 to x = 10, then a riser at
    # x = 10: nothing near the middle of the axes, where the straight chord would pass.
    fig, ax = figure
    ax.step([0, 10], [0, 10], where="post", label="step")
    ax.set(xlim=(-1, 11), ylim=(-1, 11))
    ax.legend(loc="center")
    assert covered_by_legends(fig) == []
    ax.plot([0, 10], [0, 10], label="chord")
    assert kinds(covered_by_legends(fig)) == {("chord", "line")}


# ---------------------------------------------------------------------------------------------
# Every figure of every notebook, and the roofline plot
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_notebook_legend_covers_data(notebook, tmp_path):
    pytest.importorskip("nbclient")
    from notebook_testing import execute, figures_checked, legend_coverings

    nb = execute(notebook, tmp_path)
    assert figures_checked(nb) >= 1, "the figure hook saw no figure"
    problems = legend_coverings(nb)
    message = "\n".join(
        f"{notebook.name}, code cell {p['cell']}, figure {p['figure']} ({p['title']}):\n"
        f"{describe(p['covered'])}" for p in problems)
    assert not problems, "legends cover data:\n" + message


def test_the_checker_sees_a_covering_in_a_notebook(tmp_path):
    """The in-kernel hook is live: a notebook with a legend over its line is reported."""
    pytest.importorskip("nbclient")
    import nbformat
    from notebook_testing import execute, legend_coverings

    code = ("%matplotlib inline\nimport matplotlib.pyplot as plt\n"
            "fig, ax = plt.subplots()\nax.plot([0, 1], [0, 1], label='diagonal')\n"
            "ax.set_title('probe')\nax.legend(loc='center')\nplt.show()")
    path = tmp_path / "probe.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("x"),
                                                   nbformat.v4.new_code_cell(code)]), path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    nb = execute(path, run_dir)
    assert len(nb.cells) == 2          # the report cell is gone again
    [problem] = legend_coverings(nb)
    assert problem["cell"] == 1 and problem["title"] == "probe"
    assert {(c["artist"], c["kind"]) for c in problem["covered"]} == {("diagonal", "line")}


def test_the_roofline_plot_legend_covers_no_point(tmp_path):
    import json

    import s07_roofline as roof

    bench = json.loads((ROOT / "results" / "s07_engines.json").read_text())
    r = bench["roofline"]
    peaks = roof.MachinePeaks(r["bandwidth_bytes_per_s"], r["matmul_flops_per_s"],
                              r["bandwidth_method"], r["matmul_method"])
    with matplotlib.rc_context({"figure.hooks": [f"{__name__}:_check_when_saved"]}):
        # the public pyplot hook: each figure plot_roofline makes is checked as it is saved
        _SAVED.clear()
        for name, info in bench["models"].items():
            points = [(p["label"], roof.StepCost(p["flops"], p["bytes"]), p["measured_s"])
                      for p in info["roofline_points"]]
            roof.plot_roofline(peaks, points, tmp_path / f"{name}.png", title=name)
    assert {title for title, _ in _SAVED} == set(bench["models"])   # tight_layout draws too
    for title, found in _SAVED:
        assert not found, f"roofline {title}:\n{describe(found)}"
    # closed since, the figures are still checkable: drawn again, the same verdict
    assert all(covered_by_legends(fig) == [] for fig in _FIGURES)


_SAVED: list = []
_FIGURES: list = []


def _check_when_saved(fig):
    _FIGURES.append(fig)
    fig.canvas.mpl_connect("draw_event", lambda event: _SAVED.append(
        (fig.axes[0].get_title(), covered_by_legends(fig, renderer=event.renderer))))
