"""Helpers shared by the notebook tests (tests/test_sNN_*notebook.py).

A notebook is executed with nbclient on a temporary copy (the one in the repository is never
written), with Jupyter's usual working directory, notebooks/, unless told otherwise. The kernel's
channels are CurveZMQ-encrypted where pyzmq has Curve (jupyter_client's
`KernelManager.transport_encryption = "auto"`, ipykernel declares support): without it,
ipykernel >= 7 warns on every start that it "is running over TCP without encryption".

Every figure the notebook draws is checked for legends that cover data (tests/legend_check.py):
the kernel starts with the checker installed (an IPKernelApp exec_lines entry registering a
pyplot figure hook), and one extra cell, run after the notebook's own and then removed, reads
the kernel's report back into `nb.metadata["legend_check"]` (see `legend_coverings`).
A notebook is executed once per test session for a given content and environment; later calls
get a copy of that run (the S0N notebook tests and tests/test_plot_legends.py share it).
"""
from __future__ import annotations

import copy as _copy
import hashlib
import json
import os
import shutil
from pathlib import Path

import nbclient
import nbformat
import zmq
from traitlets.config import Config

ROOT = Path(__file__).resolve().parents[1]
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
KERNEL_CONFIG = Config({"KernelManager": {
    "transport_encryption": "auto" if zmq.has("curve") else "disabled"}})


TESTS = Path(__file__).resolve().parent
LEGEND_SETUP = (f"import sys; sys.path.append({str(TESTS)!r}); "
                "import legend_check; legend_check.install()")
LEGEND_REPORT = "import legend_check as _legend_check; print(_legend_check.report_json())"
_RUNS: dict = {}


def _run_key(notebook: Path, timeout: int) -> str:
    digest = hashlib.sha256(Path(notebook).read_bytes())
    digest.update(repr((str(Path(notebook).resolve()), timeout, sorted((k, v) for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"))).encode())
    return digest.hexdigest()


def execute(notebook: Path, workdir: Path, timeout: int = 180):
    """Run a copy of `notebook` in `workdir` (a temp folder) from notebooks/; return it executed.

    Raises nbclient's CellExecutionError, with the failing cell and its traceback, if a cell
    fails. The executed copy is written back to `workdir` for a look after a failure. The legend
    report is in the returned notebook's metadata (`legend_coverings` reads it).
    """
    copy = Path(workdir) / notebook.name
    key = _run_key(notebook, timeout)
    if key in _RUNS:
        nb = _copy.deepcopy(_RUNS[key])
        nbformat.write(nb, copy)
        return nb
    shutil.copy(notebook, copy)
    nb = nbformat.read(copy, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(LEGEND_REPORT))
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(notebook.parent)}},
                                     config=KERNEL_CONFIG,
                                     extra_arguments=[f"--IPKernelApp.exec_lines={LEGEND_SETUP}"])
    client.execute()
    probe = nb.cells.pop()
    printed = "".join(o.get("text", "") for o in probe.outputs if o.output_type == "stream")
    nb.metadata["legend_check"] = json.loads(printed.strip().splitlines()[-1])
    nbformat.write(nb, copy)
    _RUNS[key] = _copy.deepcopy(nb)
    return nb


def legend_coverings(nb) -> list[dict]:
    """The report of an executed notebook: one entry per figure state (a draw) in which a
    legend covered data, with the code cell (index among all cells) that drew it."""
    cells = {c.source: i for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    report = nb.metadata["legend_check"]["covered"]
    return [dict(entry, cell=cells.get(entry["cell_source"])) for entry in report]


def figures_checked(nb) -> int:
    """How many pyplot figures the notebook made (all were checked at every draw)."""
    return nb.metadata["legend_check"]["figures"]


def outputs(nb) -> list:
    """Every output of every code cell, in order."""
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]


def stream_text(nb) -> str:
    """All printed (stdout/stderr stream) text of an executed notebook."""
    return "\n".join(out.get("text", "") for out in outputs(nb) if out.output_type == "stream")


def assert_committed_without_outputs(notebook: Path) -> None:
    """The notebook in the repository is valid and carries no outputs or execution counts
    (machine-specific timings stay out of git; the site and the tests execute it)."""
    nb = nbformat.read(notebook, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)


def code_source(notebook: Path) -> str:
    """All code cells of the committed notebook, joined."""
    nb = nbformat.read(notebook, as_version=4)
    return "\n".join(c.source for c in nb.cells if c.cell_type == "code")
