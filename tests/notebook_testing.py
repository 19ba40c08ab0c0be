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
A notebook is executed once per test run for a given content and environment; later calls get
a copy of that run (its S0N notebook test, tests/test_plot_legends.py and the site build of
tests/site_testing.py share it), across pytest-xdist's worker processes too: the first process to
lock a notebook runs it and stores the result in the run's shared folder (COURSE_TEST_RUN_DIR,
set by tests/conftest.py); the others wait on the lock and read it. The kernel runs in the
environment the test run started with (`kernel_env`), not one that tests have changed since.
"""
from __future__ import annotations

import contextlib
import copy as _copy
import fcntl
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
RUN_DIR_ENV = "COURSE_TEST_RUN_DIR"   # the folder shared by this run's processes (conftest.py)
KERNEL_ENV = "COURSE_TEST_KERNEL_ENV"  # the environment before any test module loaded (conftest.py)


def kernel_env() -> dict[str, str]:
    """The environment a notebook's kernel runs in: the test run's own, as tests/conftest.py
    saved it before any test module loaded, else (outside pytest) this process's."""
    saved = os.environ.get(KERNEL_ENV)
    env = json.loads(saved) if saved else dict(os.environ)
    for name in (KERNEL_ENV, RUN_DIR_ENV):
        env.pop(name, None)
    return env


def _run_key(notebook: Path) -> str:
    """The notebook's bytes, path and the environment its kernel gets (pytest's own variables,
    which differ between worker processes, left out)."""
    env = sorted((k, v) for k, v in kernel_env().items() if not k.startswith("PYTEST_"))
    digest = hashlib.sha256(Path(notebook).read_bytes())
    digest.update(repr((str(Path(notebook).resolve()), env)).encode())
    return digest.hexdigest()


def execute(notebook: Path, workdir: Path, timeout: int = 180):
    """Run a copy of `notebook` in `workdir` (a temp folder) from notebooks/; return it executed.

    timeout: seconds per cell. Raises nbclient's CellExecutionError, with the failing cell and
    its traceback, if a cell fails. The executed copy is written back to `workdir` for a look
    after a failure. The legend report is in the returned notebook's metadata
    (`legend_coverings` reads it). A notebook already run in this test run is not run again
    (see the module's docstring): its cells then kept to the timeout of the run that executed it.
    """
    copy = Path(workdir) / notebook.name
    shutil.copy(notebook, copy)
    nb = executed(notebook, timeout)
    nbformat.write(nb, copy)
    return nb


def execute_all(notebooks: list[Path], timeout: int) -> dict[Path, object]:
    """`executed` for each notebook, running first those no other process is running now (so
    two processes that need the same notebooks run different ones side by side), then waiting
    for the others. Returns {notebook: executed notebook}."""
    done = {}
    for notebook in notebooks:
        nb = executed(notebook, timeout, wait=False)
        if nb is not None:
            done[notebook] = nb
    for notebook in notebooks:
        if notebook not in done:
            done[notebook] = executed(notebook, timeout)
    return done


def executed(notebook: Path, timeout: int = 180, wait: bool = True):
    """`notebook` run once in this test run (a copy of the run; the repository's file is never
    written), or None when wait is False and another process is running it now."""
    key = _run_key(notebook)
    if key not in _RUNS:
        run_dir = os.environ.get(RUN_DIR_ENV)
        if run_dir is None:                       # no shared folder: run it in this process
            _RUNS[key] = _run(notebook, timeout)
        else:
            store = Path(run_dir) / "executed-notebooks"
            store.mkdir(parents=True, exist_ok=True)
            with _locked(store / f"{key}.lock", wait) as locked:
                if not locked:
                    return None
                path = store / f"{key}.ipynb"
                if path.exists():
                    _RUNS[key] = nbformat.read(path, as_version=4)
                else:
                    nb = _run(notebook, timeout)
                    nbformat.write(nb, path.with_suffix(".partial"))
                    os.replace(path.with_suffix(".partial"), path)   # never read half-written
                    _RUNS[key] = nb
    return _copy.deepcopy(_RUNS[key])


@contextlib.contextmanager
def _locked(path: Path, wait: bool):
    """An exclusive lock on `path` (yields True), or, when wait is False and another process
    holds it, no lock (yields False)."""
    with open(path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(notebook: Path, timeout: int):
    """Execute `notebook` with nbclient from its folder, the legend checker installed."""
    nb = nbformat.read(notebook, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(LEGEND_REPORT))
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(notebook.parent)}},
                                     config=KERNEL_CONFIG,
                                     extra_arguments=[f"--IPKernelApp.exec_lines={LEGEND_SETUP}"])
    client.execute(env=kernel_env())
    probe = nb.cells.pop()
    printed = "".join(o.get("text", "") for o in probe.outputs if o.output_type == "stream")
    nb.metadata["legend_check"] = json.loads(printed.strip().splitlines()[-1])
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
