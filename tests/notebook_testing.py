"""Helpers shared by the notebook tests (tests/test_sNN_*notebook.py).

A notebook is executed with nbclient on a temporary copy (the one in the repository is never
written), with Jupyter's usual working directory, notebooks/, unless told otherwise. The kernel's
channels are CurveZMQ-encrypted where pyzmq has Curve (jupyter_client's
`KernelManager.transport_encryption = "auto"`, ipykernel declares support): without it,
ipykernel >= 7 warns on every start that it "is running over TCP without encryption".
"""
from __future__ import annotations

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


def execute(notebook: Path, workdir: Path, timeout: int = 180):
    """Run a copy of `notebook` in `workdir` (a temp folder) from notebooks/; return it executed.

    Raises nbclient's CellExecutionError, with the failing cell and its traceback, if a cell
    fails. The executed copy is written back to `workdir` for a look after a failure.
    """
    copy = Path(workdir) / notebook.name
    shutil.copy(notebook, copy)
    nb = nbformat.read(copy, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(notebook.parent)}},
                                     config=KERNEL_CONFIG)
    client.execute()
    nbformat.write(nb, copy)
    return nb


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
